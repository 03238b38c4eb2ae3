"""The Ray Serve application: OIP v2 REST ingress in front of a batched model deployment."""
