"""A shard as computation: backends, weights, manifest, recipes, doctor, sampling, store."""
