"""Load balancing by lightweight expert replication (Pro-Prophet). See docs/balance.md."""
