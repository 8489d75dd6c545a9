"""Baseline PTQ methods, one module each; every module registers its method with lrq.methods.register."""
