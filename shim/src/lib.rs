//! vessel-shim: the per-VM host process. Built by the vmm issue; empty until then.
