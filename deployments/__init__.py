"""vitserve.deployments: Ray Serve deployments, app builders, config, metrics and the CLI."""
