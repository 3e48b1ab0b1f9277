// Package topology holds kvmount's tests against each store as operators
// run it in production, not a single development server: Vault as an HA
// cluster with integrated storage behind a load balancer, Consul as a
// cluster of servers behind a client agent, etcd through its gRPC proxy.
// Each test starts the real cluster on loopback addresses, builds and
// runs the kvmount binary as a daemon, injects the topology's faults — a
// node killed, frozen, sealed, stepped down; the whole cluster restarted;
// kvmount killed — and checks the histories its readers
// recorded: never a mixed version, never backwards, staleness reported,
// and every mount current again within its bar once the store answers.
//
// The package has no code of its own outside its tests.
package topology
