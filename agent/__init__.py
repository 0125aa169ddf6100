"""jetson-agent: an edge deployment agent for NVIDIA Jetson fleets."""

__version__ = "0.1.0"
