"""``engine score --ray``: a backfill on Ray Data, one engine per actor, one committed Parquet file per input block."""
