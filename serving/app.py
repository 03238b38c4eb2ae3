"""The raylane Ray Serve application.

    serve run serving/config.yaml            # local, from the repository root
    serve deploy serving/config.yaml         # onto a running cluster (RAY_AUTH_MODE=token)

`app` is a Serve application builder: Serve calls it with the `args` of the config file
(`config`: a raylane YAML, `overrides`: `key.path=value` strings). The deployments themselves
live in `raylane.serving`, installed on every node with the package.
"""

from raylane.serving.app import app_builder

app = app_builder
