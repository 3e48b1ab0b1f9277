package reconcile

// Every pass of the reconcilers this package's tests run checks the
// mounts it plans against a plan of every mount (changes.go).
func init() { verifyPlans = true }
