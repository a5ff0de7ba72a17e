"""The endpoint kind: POST the item to a URL, read its reward."""
