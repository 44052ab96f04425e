"""Our own .proto files (from the wire facts in shared/reference) and their generated stubs.

Regenerate with ``make protos``; never edit ``*_pb2*.py`` by hand.
"""
