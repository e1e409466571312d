"""`python -m sdbench` runs the command line, as the `sdbench` script does."""

from sdbench.cli import main

if __name__ == "__main__":
    main()
