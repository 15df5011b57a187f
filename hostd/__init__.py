"""hostd: mounts fusefs at /mnt/kv-cache and connects it to bluecached."""
