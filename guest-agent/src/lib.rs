//! vessel-agent: the pod agent and its gRPC API. Built by the flat pods issue; empty until then.
