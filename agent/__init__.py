"""sysdra agent: command line, kubelet plugin, ResourceSlice publishing, service plumbing."""
