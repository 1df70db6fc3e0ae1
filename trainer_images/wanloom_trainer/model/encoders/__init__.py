"""The encoders the transformer is conditioned on, in JAX, for TPU hosts without PyTorch: the Wan VAE (2.1 and 2.2;
encode for data preparation, decode for validation videos) and the umT5/T5 text encoder with its tokenizer. Names
follow the diffusers and transformers checkpoints they load."""
