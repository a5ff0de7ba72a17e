"""Backfills: score a file of rows, resumably, and benchmark verifiers on one."""
