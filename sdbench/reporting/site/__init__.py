"""`sdbench site`: a static, browsable site of many results (site/build.py)."""
