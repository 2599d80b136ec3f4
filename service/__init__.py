"""The eplb balancer service (installed as ``eplb_service``)."""
