"""ipvsproxy: Kubernetes Service virtual IPs with the kernel's IPVS load balancer."""

__version__ = "0.1.0"
