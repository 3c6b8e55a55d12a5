"""`python -m ipvsproxy` runs the command-line interface."""

from ipvsproxy.cli import main

main()
