"""moe_w4a16: the routed-expert block of Kimi K2.x (routing + expert FFNs); see reference.py."""

from plugins.moe_w4a16.reference import experts_reference, route_reference

__all__ = ["route_reference", "experts_reference"]
