"""The spec language: expressions, spec files, the torch evaluator and the shipped library."""
