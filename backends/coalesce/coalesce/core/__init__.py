"""Core types shared by every component: errors, tensor specs and the task interface."""
