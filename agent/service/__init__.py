"""The running daemon: wiring (``daemon``), event sources, status socket, metrics, sd_notify."""
