"""kdtree build pipeline: config, checkpoint loading, planning, sharding, export, compile, cache."""
