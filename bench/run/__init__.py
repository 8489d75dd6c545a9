"""Running cells: the planner's estimates, a request settled into a cell and executed (cell), executors,
run profiles, sweeps over many cells, and the ledger that carries a long run across machines."""
