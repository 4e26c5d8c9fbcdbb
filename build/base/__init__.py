"""Bases: bootstrapped Debian bases pinned by their deb lock, and what a base holds (README.md here)."""
