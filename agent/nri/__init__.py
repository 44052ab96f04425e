"""NRI (Node Resource Interface): the agent as a plugin of the container runtime."""
