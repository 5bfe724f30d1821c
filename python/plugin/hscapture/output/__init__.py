"""What is written and read back: format descriptors (from the core), the output directory's lock,
the object store client, the workers' failure records, and the readers."""
