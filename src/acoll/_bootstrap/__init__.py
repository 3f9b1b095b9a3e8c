"""Bootstrap: the root server, the rank-side ring, and their wire format."""
