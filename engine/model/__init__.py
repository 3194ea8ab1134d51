"""The Llama-family decoder, its Hugging Face loader, tokenizers and a tiny checkpoint writer."""
