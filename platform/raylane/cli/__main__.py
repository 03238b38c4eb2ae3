"""`python -m raylane.cli ...`: the `raylane` command."""

from raylane.cli import main

main()
