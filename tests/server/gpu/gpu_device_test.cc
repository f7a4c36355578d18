// Needs a GPU (CTest label gpu); every test skips when ListGpus() fails. Covers
// MakeCudaSlabAllocator + DevicePool, DeviceContext (copies both ways, ready event, waiting for
// an interprocess event of another process) and MakeCudaDeviceCopier.
