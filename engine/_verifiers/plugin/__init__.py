"""The plugin kind: a vetted module's callable, in threads or worker processes."""
