"""The notebook side: starting ranks, sending them work, bringing results back."""
