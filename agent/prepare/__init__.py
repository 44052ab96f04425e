"""Device logic behind NodePrepareResources/NodeUnprepareResources: the driver, its
checkpoint, and what prepare writes (CDI spec files, KEP-5304 metadata)."""
