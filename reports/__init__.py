"""Report templates and, later, committed reference results."""
