"""The Ray Serve application: OIP v2 REST ingress in front of a batched model deployment."""

APP_NAME = "raylane"  # the Serve application raylane deploys, rolls and reports on
