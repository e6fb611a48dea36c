"""Test support: the oracle, ramp datasets, shared keymaps, planner and daemon helpers."""
