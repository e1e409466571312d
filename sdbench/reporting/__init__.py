"""Results on disk and what is made of them: Parquet rows, tables, intervals, plots, HTML, comparisons."""
