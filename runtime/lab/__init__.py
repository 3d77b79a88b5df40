"""The WAN lab: network namespaces with delay, loss, rate and NAT routers (docs/lab.md)."""
