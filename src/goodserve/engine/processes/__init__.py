"""The processes goodserve starts for itself: their startup heap, and stopping when told."""
