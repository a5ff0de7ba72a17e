"""The plugin kind: a vetted module's callable, on the event loop, in threads or in worker processes."""
