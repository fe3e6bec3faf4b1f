"""The model: args -> megatron-core config and layer spec (builder), and the attention, MLA,
gpt-oss and embedding pieces the spec is customised with."""
