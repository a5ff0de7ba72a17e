"""Environments: a directory's manifest and the digest that pins its contents."""
