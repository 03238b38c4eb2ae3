"""The Ray Serve application: OIP v2 REST ingress in front of a batched model deployment."""

APP_NAME = "raylane"  # the default Serve application name (`serving.app_name`)
