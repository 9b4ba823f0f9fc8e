"""Everything replicas share through the object store: storage, wire format, all-reduce, manager, checkpoints."""
