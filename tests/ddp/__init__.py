"""Two real processes on gloo: the rank-0 validation video."""
