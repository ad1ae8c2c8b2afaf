"""Whole models through the targets: export time and memory, bytes against the planner, decode speed."""
