"""KEP-5304 device metadata: a JSON file per prepared request, bind-mounted read-only
into the containers through a CDI spec (docs/device-metadata.md).

- ``stream``: the ``DeviceMetadata`` object, ``encode`` and the tolerant reader
  ``decode`` / ``read_file`` (first understood version wins; useful for ``sysdra doctor``);
- ``layout``: host paths, in-container paths, the per-request CDI spec;
- ``store``: what ``agent.prepare.driver.Driver`` calls on prepare, unprepare and recovery;
- ``update``: deferred updates (``sysdra metadata update``) with ``generation + 1``.
"""

from agent.prepare.metadata.stream import VERSIONS, MetadataError, decode, encode, read_file

__all__ = ["VERSIONS", "MetadataError", "decode", "encode", "read_file"]
