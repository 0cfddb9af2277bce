"""The shard's pure core: decisions are functions of (state, now, config); no grpc, no I/O."""
