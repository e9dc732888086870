//! vessel-vmm: the microVM monitor. Built by the vmm issue; empty until then.
