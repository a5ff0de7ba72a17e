"""The verdict cache: the judge's successful verdicts, kept in SQLite between batches and processes."""
