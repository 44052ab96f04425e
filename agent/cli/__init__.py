"""The ``sysdra`` command line: ``main.py`` dispatches, one module per subcommand."""
