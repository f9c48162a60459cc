"""Triton's model configuration schema (`model_config.proto`, vendored under its licence in
`LICENSE`) and the module generated from it, against which `config.pbtxt` is parsed."""
